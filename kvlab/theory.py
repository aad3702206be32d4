POINT_KEYS = ("cache", "pattern", "strategy", "batch", "prompt", "new", "restart_new", "num_beams", "dtype", "chunk_limit", "block_tokens")
def predict_overhead(config, **k):
    return 0
