"""The core's own defaults against their contracts."""

from engine.testing.kv_cache import KVCacheManagerContract
from engine.testing.scheduler import SchedulerContract


class TestDefaultKVCacheManager(KVCacheManagerContract):
    manager_name = "default"


class TestDefaultScheduler(SchedulerContract):
    scheduler_name = "default"
