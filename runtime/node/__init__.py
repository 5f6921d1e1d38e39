"""A node's life: its configuration (flags and config files), the supervisor that creates
its shared memory and starts and watches its processes, and `kvrt status`/`kvrt clean`."""
