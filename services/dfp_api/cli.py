"""Command-line entry points of the api service."""

import click


@click.group(name="api")
def group():
    """api service commands."""
