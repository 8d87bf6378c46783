"""The edge: HTTP routes, wire protocols (native, V2), the guard, and the one error table."""
