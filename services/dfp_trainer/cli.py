"""Command-line entry points of the trainer service."""

import click


@click.group(name="trainer")
def group():
    """trainer service commands."""
