"""HTTP layer: dependencies and routers under /api/v1."""
