"""Ray Serve application for gpt-oss: `serve run serve_app:app [key=value ...]`.

`app` is a Serve application builder (a function of the argument dict), so the package stays light to
import: the torch-free ingress replicas import `serve_app` too, and only the builder pulls in the rest.
"""


def app(args: dict):
    """Build the application from `serve run` arguments or a Serve YAML's `args:` (see serve_app/config.py)."""
    from serve_app.builder import build_app

    return build_app(args)
