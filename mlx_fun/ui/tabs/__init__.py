"""One module per dashboard tab, in page order; each has ``build(ctx)``, called inside the page's ``gr.Blocks``
(and a few plain functions that its tests call directly)."""

from . import chat, controls, dashboard, diff, merge, steering

TABS = [("Chat", chat), ("Dashboard", dashboard), ("Steering", steering), ("Merge Mode Comparison", merge),
        ("Diff Analysis", diff), ("Controls", controls)]
