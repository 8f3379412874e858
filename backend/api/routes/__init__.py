"""One router per resource; each route is thin and calls backend.persistence.crud."""
