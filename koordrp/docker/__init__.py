"""Docker mode: the Docker Engine API proxied to dockerd, with the same runtime hooks."""
