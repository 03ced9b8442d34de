from torchtune_dtf.models.routing_config import REQUIRED_KEYS, RoutingSpec, validate_routing
