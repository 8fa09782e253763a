import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine threads that wait
# for each other make every small matmul orders of magnitude slower.
torch.set_num_threads(1)
