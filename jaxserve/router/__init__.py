"""Prefix-aware routing across replicas (`python -m jaxserve.router --config configs/router.yaml`)."""
