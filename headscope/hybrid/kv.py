def kv_cache_report(): pass
