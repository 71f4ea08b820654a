"""An in-memory stand-in for the coordination service's key-value store (jaxserve.distributed.runtime.client),
for ProcessGroups of several "processes" that are threads of one test."""

import threading


class MemoryKeyValueStore:
    """The calls ProcessGroup.exchange makes, with the coordination service's timeout error."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.values[key]
