"""The admin API's routers, one module per concern, each exposing ``routes(backend) -> APIRouter``."""
