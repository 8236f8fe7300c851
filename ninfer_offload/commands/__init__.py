"""One module per `ninfer` command; each exposes a function that cli.py registers."""
