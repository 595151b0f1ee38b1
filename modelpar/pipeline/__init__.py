"""Pipeline execution with torch: the threaded ``Pipe`` (one process) and the multi-process runtime."""
