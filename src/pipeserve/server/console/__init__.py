"""The web console at `/` (docs/console.md): static files shipped in this package
(plain ES modules and CSS, no build step, nothing fetched from elsewhere) and a few JSON
endpoints under /console/api/ (`api.py`), added by `routes.py`. `server.console: false`
turns it off."""
