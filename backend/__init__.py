"""TLT Studio's control plane: FastAPI app (backend.main:create_app), SQLAlchemy models, persistence (backend.crud),
artifact and dataset stores. Imports no torch; the job spec comes from worker.tlt.config."""
