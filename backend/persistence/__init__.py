"""The persistence layer that the API and the worker share: SQLAlchemy models (`models`), the engine and session
factory (`db`), and the queries and writes (`crud`). Callers import it by name:
`from backend.persistence import crud` / `from backend.persistence.models import Job`."""
