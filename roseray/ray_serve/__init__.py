"""roseray on Ray Serve: Engine and Router deployments, the routing policy, router tickets."""
