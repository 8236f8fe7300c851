"""One module per `ninfer` command, each exposing a function that cli.py registers; `loadable` is the
load check of `ninfer inspect --verify`."""
