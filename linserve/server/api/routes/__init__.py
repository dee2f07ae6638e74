"""Thin FastAPI routers, one per resource."""
