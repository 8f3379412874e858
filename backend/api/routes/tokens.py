"""API tokens (admin only: create for any user, list, revoke) and the caller's own identity."""

from __future__ import annotations

from fastapi import APIRouter, status

from backend import crud
from backend.api.deps import AdminUser, CurrentUser, SessionDep, TokenId
from backend.models import ApiToken, User
from backend.schemas import TokenCreate, TokenCreated, TokenPublic, UserPublic

router = APIRouter(tags=["tokens"])


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(body: TokenCreate, session: SessionDep, _admin: AdminUser) -> TokenCreated:
    """The secret is in this response only; it is stored hashed."""
    token, secret = crud.create_token(session, body.user, admin=body.admin, name=body.name)
    return TokenCreated.model_validate({**TokenPublic.model_validate(token).model_dump(), "token": secret})


@router.get("/tokens", response_model=list[TokenPublic])
def list_tokens(session: SessionDep, _admin: AdminUser):
    return crud.list_tokens(session)


@router.delete("/tokens/{token_id}", response_model=TokenPublic)
def revoke_token(token_id: TokenId, session: SessionDep, _admin: AdminUser) -> ApiToken:
    return crud.revoke_token(session, token_id)


@router.get("/users/me", response_model=UserPublic)
def me(user: CurrentUser) -> User:
    return user
