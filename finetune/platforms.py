"""Where a run happens: credentials and reachability of the hubs we download from.

Checked up front so that an offline machine gets a clear message in seconds
instead of a download library's retries.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def kaggle_credentials_present() -> bool:
    """KAGGLE_USERNAME + KAGGLE_KEY, a token variable, or ~/.kaggle/kaggle.json (values never read here)."""
    if os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY"):
        return True
    if os.environ.get("KAGGLE_API_TOKEN"):
        return True
    config_dir = Path(os.environ.get("KAGGLE_CONFIG_DIR", Path.home() / ".kaggle"))
    return (config_dir / "kaggle.json").is_file() or (config_dir / "access_token").is_file()


def in_kagglehub_cache(handle: str) -> bool:
    """kagglehub keeps models under <cache>/models/<owner>/<model>/<framework>/<variation>."""
    cache = Path(os.environ.get("KAGGLEHUB_CACHE", Path.home() / ".cache" / "kagglehub"))
    parts = handle.removeprefix("kaggle://").split("/")
    variation = parts[3] if len(parts) >= 4 else parts[-1]
    return any(cache.glob(f"models/*/*/*/{variation}"))


def use_hugging_face_cache_only_when_offline() -> None:
    """Without a route to the Hub, make `datasets` read its cache instead of retrying for half a minute."""
    if not os.environ.get("HF_HUB_OFFLINE") and not reachable("huggingface.co"):
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
