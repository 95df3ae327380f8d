"""Command-line entry points of the tokenizer service."""

import click


@click.group(name="tokenizer")
def group():
    """tokenizer service commands."""
