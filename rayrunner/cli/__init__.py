"""The `rayrunner` command: run the service, and manage and talk to a running one over its HTTP API.

`api` is the HTTP client (every failure becomes one `CliError` line), `tables` renders `ps`, `conversation`
streams `chat` and `run` answers, and `commands` holds the typer app.
"""

from rayrunner.cli.commands import app


def main() -> None:
    """The console script's entry point."""
    app(prog_name="rayrunner")


__all__ = ["app", "main"]
