"""Users and API tokens: create (the secret is returned once, only its hash stored), look up, list, revoke."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from backend.core.security import hash_token, new_token
from backend.persistence.crud.common import Conflict, Forbidden, NotFound
from backend.persistence.models import ApiToken, User, utcnow


def get_or_create_user(session: Session, name: str, *, admin: bool = False) -> User:
    user = session.scalar(select(User).where(User.name == name))
    if user is None:
        user = User(name=name, is_admin=admin)
        session.add(user)
        try:
            session.flush()
        except IntegrityError:  # created concurrently
            session.rollback()
            user = session.scalars(select(User).where(User.name == name)).one()
    return user


def create_token(session: Session, user_name: str, *, admin: bool = False, name: str = "",
                 promote: bool = False) -> tuple[ApiToken, str]:
    """A new token for `user_name` (the user is created if new, as admin when `admin`). Returns (row, secret).
    The token is an admin token only when `admin`; an admin token for an existing non-admin user needs `promote`
    (which makes the user an admin), else Conflict: a role never changes silently."""
    user = get_or_create_user(session, user_name, admin=admin)
    if admin and not user.is_admin:
        if not promote:
            session.rollback()
            raise Conflict(f"user {user_name!r} exists and is not an admin; promote them explicitly "
                           "(`tlt token create --admin --promote`, API: promote=true) or create a non-admin token")
        user.is_admin = True
    secret = new_token()
    token = ApiToken(user_id=user.id, name=name, token_hash=hash_token(secret), prefix=secret[:12], admin=admin)
    session.add(token)
    session.commit()
    session.refresh(token)
    return token, secret


# Every request runs this, so it is built once: building a select costs more CPU than SQLite spends answering it.
# Revocation takes effect at once because every request reads revoked_at (no cache).
_LIVE_TOKEN = (select(User, ApiToken.id, ApiToken.last_used_at, ApiToken.admin)
               .join(ApiToken, ApiToken.user_id == User.id)
               .where(ApiToken.token_hash == bindparam("token_hash"), ApiToken.revoked_at.is_(None)))
_TOUCH_TOKEN = (update(ApiToken).where(ApiToken.id == bindparam("token_id"))
                .values(last_used_at=bindparam("now", type_=ApiToken.last_used_at.type))
                .execution_options(synchronize_session=False))


def user_for_token(session: Session, secret: str) -> User | None:
    """The user of a live (not revoked) token, else None: one indexed query (token_hash is unique). A non-admin
    token of an admin user yields the user as a non-admin (detached from the session, so the role is never written
    back)."""
    row = session.execute(_LIVE_TOKEN, {"token_hash": hash_token(secret)}).one_or_none()
    if row is None:
        return None
    user, token_id, last_used_at, token_admin = row
    if user.is_admin and not token_admin:
        session.expunge(user)
        set_committed_value(user, "is_admin", False)
    now = utcnow()
    if last_used_at is None or last_used_at < now - timedelta(minutes=1):  # throttled: not one write per request
        session.execute(_TOUCH_TOKEN, {"token_id": token_id, "now": now})
        session.commit()
    return user


def count_live_tokens(session: Session, user_name: str) -> int:
    """Unrevoked tokens of the user named `user_name` (0 for an unknown name)."""
    stmt = (select(func.count()).select_from(ApiToken).join(User, User.id == ApiToken.user_id)
            .where(User.name == user_name, ApiToken.revoked_at.is_(None)))
    return int(session.scalar(stmt) or 0)


_TOKEN_LIVE = select(ApiToken.id).where(ApiToken.token_hash == bindparam("token_hash"), ApiToken.revoked_at.is_(None))


def token_is_live(session: Session, secret: str) -> bool:
    """Whether the token exists and is not revoked (a read only: an open stream re-checks its token with it)."""
    return session.execute(_TOKEN_LIVE, {"token_hash": hash_token(secret)}).first() is not None


def list_tokens(session: Session, owner: User | None = None) -> Sequence[ApiToken]:
    """All tokens, or only `owner`'s."""
    stmt = select(ApiToken)
    if owner is not None:
        stmt = stmt.where(ApiToken.user_id == owner.id)
    return session.scalars(stmt.order_by(ApiToken.id)).all()


def revoke_token(session: Session, token_id: int, owner: User | None = None, *, by_admin: bool = True) -> ApiToken:
    """Revoke (idempotent). With `owner`, only that user's token: another's is NotFound (ids don't leak). An admin
    token is revoked only `by_admin` (an admin token): a lesser token of the same user is Forbidden."""
    token = session.get(ApiToken, token_id)
    if token is None or (owner is not None and token.user_id != owner.id):
        raise NotFound(f"token {token_id} not found")
    if token.admin and not by_admin:
        raise Forbidden(f"token {token_id} is an admin token: only an admin token revokes it")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.commit()
    return token
