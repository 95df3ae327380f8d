"""Running things locally: a private Redis server, free ports, and process groups that stop together."""
