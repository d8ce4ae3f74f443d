"""The live web view (``/ui``): what the page shows (:mod:`.snapshot`) and the page itself (``static/``, shipped
as package data: plain JS + SVG, no build step, nothing fetched from a CDN). Routes: :mod:`parrot.api.ui_routes`."""
