"""`tlt db upgrade` and `tlt token create`: local commands that talk to the database directly (no API)."""

from __future__ import annotations

import argparse
import sys

from worker.cli.output import EXIT_API, out


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from backend.core.config import get_settings
    from backend.core.migrate import upgrade

    settings = get_settings()
    settings.ensure_dirs()
    upgrade(settings.database_url)
    out(f"database at head: {settings.database_url}")
    return 0


def create_token(user: str, admin: bool, name: str = "", promote: bool = False) -> str:
    """A new token's secret. An admin token only when `admin`; for an existing non-admin user that also needs
    `promote` (else crud.Conflict)."""
    from backend.core.config import get_settings
    from backend.persistence import crud
    from backend.persistence.db import make_engine, make_session_factory

    engine = make_engine(get_settings().database_url)
    try:
        with make_session_factory(engine)() as s:
            _, secret = crud.create_token(s, user, admin=admin, name=name, promote=promote)
    finally:
        engine.dispose()
    return secret


def cmd_token_create(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from backend.core.config import get_settings
    from backend.persistence import crud

    if args.promote and not args.admin:
        sys.stderr.write("tlt: --promote makes the user an admin and needs --admin\n")
        return 2
    try:
        out(create_token(args.user, args.admin, args.name, promote=args.promote))
    except crud.Conflict as e:
        sys.stderr.write(f"tlt: {e}\n")
        return EXIT_API
    except SQLAlchemyError as e:  # no database there yet, or one not migrated: one line, not a traceback
        reason = str(getattr(e, "orig", None) or e).splitlines()[0]
        sys.stderr.write(f"tlt: cannot use the database {get_settings().database_url} ({reason}); start the service "
                         "once (`tlt up`) or run `tlt db upgrade`, or point TLT_HOME / TLT_DATABASE_URL at its home\n")
        return EXIT_API
    return 0
