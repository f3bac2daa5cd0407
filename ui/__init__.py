"""The web app's user interface: the Gradio page, one module per tab or panel, the handlers of its events,
the formatting of typed results for people, and the web layer's security middleware.

Besides `app.py` (which parses the flags and launches), this is the only place that imports gradio. It may
use any of `migration`; nothing of `migration` imports it. Importing the package first points Gradio's
temporary folder (uploads and served files) at a private folder of the cache directory: Gradio reads the
variable when it is imported.
"""

import os

from migration.common import cache_dir

os.environ.setdefault("GRADIO_TEMP_DIR", str(cache_dir() / "gradio"))
