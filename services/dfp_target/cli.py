"""Command-line entry points of the target service."""

import click


@click.group(name="target")
def group():
    """target service commands."""
