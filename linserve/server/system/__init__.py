"""What the server takes from the machine: the CPUs it may use (``cpus``), how the
allocator returns memory (``malloc``) and where its resident memory goes (``memory``)."""
