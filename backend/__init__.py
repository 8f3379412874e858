"""TLT Studio's control plane: FastAPI app (backend.main:create_app), the persistence package that the worker shares
(backend.persistence: models, db, crud), artifact and dataset stores. Imports no torch; the job spec comes from worker.tlt.config."""
