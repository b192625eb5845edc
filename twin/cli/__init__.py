"""The `twin` command: one module per command group, registered on one typer app in this order."""
from twin.cli.common import app
from twin.cli import run, info, compare, plan, predictor, lab  # noqa: F401,E402  (each registers its commands)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
