"""`python -m sglang_admin` runs the CLI."""

from sglang_admin.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
