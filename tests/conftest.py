import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton experts kernels run under Triton's interpreter on the CPU. Triton reads this when its language module is
# first imported (transformers imports it early), so it is set for the whole session; nothing else here uses Triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
