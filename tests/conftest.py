import os

# Models are local directories: never reach for a hub (this machine has none).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
