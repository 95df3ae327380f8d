"""Command-line entry points of the generation service."""

import click


@click.group(name="generation")
def group():
    """generation service commands."""
