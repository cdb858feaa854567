"""python -m zkern.config check ds_config.json: what zkern makes of a config file (report.py)."""

from zkern.config.report import main

if __name__ == "__main__":
    raise SystemExit(main())
