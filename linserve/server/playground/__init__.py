"""The built-in web playground and the offline API docs: static files and the routes that
serve them (no CDN, no network at run time)."""
