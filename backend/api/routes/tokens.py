"""API tokens and the caller's own identity. An admin creates tokens for anyone (and admins), lists and revokes all;
any user may create, list and revoke their own non-admin tokens (others' tokens are a 403 to create, 404 to revoke;
an admin token is revoked only with an admin token, 403). Listings show no character of a secret.
A token is an admin token only when created with admin=true; for an existing non-admin user that also needs
promote=true (else 409)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from backend.api.deps import CurrentUser, SessionDep, SettingsDep, TokenId
from backend.persistence import crud
from backend.persistence.models import ApiToken, User
from backend.schemas import TokenCreate, TokenCreated, TokenPublic, UserPublic, errors
from backend.user_limits import check_live_tokens

router = APIRouter(tags=["tokens"], responses=errors(403, 404, 409))


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(body: TokenCreate, session: SessionDep, user: CurrentUser, settings: SettingsDep) -> TokenCreated:
    """The secret is in this response only; it is stored hashed. Non-admins: only for themselves, never admin.
    A user holds at most TLT_MAX_TOKENS_PER_USER live tokens (409 beyond)."""
    if not user.is_admin and (body.user != user.name or body.admin):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only an admin creates tokens for others or admin tokens")
    check_live_tokens(session, body.user, settings)
    token, secret = crud.create_token(session, body.user, admin=body.admin, name=body.name, promote=body.promote)
    return TokenCreated.model_validate({**TokenPublic.model_validate(token).model_dump(), "token": secret})


@router.get("/tokens", response_model=list[TokenPublic])
def list_tokens(session: SessionDep, user: CurrentUser):
    """All tokens for an admin, one's own otherwise (never the secrets)."""
    return crud.list_tokens(session, None if user.is_admin else user)


@router.delete("/tokens/{token_id}", response_model=TokenPublic)
def revoke_token(token_id: TokenId, session: SessionDep, user: CurrentUser) -> ApiToken:
    """One's own token (admins: anyone's). An admin token is revoked only with an admin token (403 otherwise), so a
    lesser token of an admin user cannot take away the stronger one."""
    return crud.revoke_token(session, token_id, None if user.is_admin else user, by_admin=user.is_admin)


@router.get("/users/me", response_model=UserPublic)
def me(user: CurrentUser) -> User:
    return user
