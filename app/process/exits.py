"""The exit statuses of ffn-serve, apart from the server so that the command can use one before
it imports the server (and torch): 0 stopped cleanly (drained); 1 a model could not be loaded, or
the server failed while starting; 2 invalid settings or command line, or a file or device they
name that cannot be used as asked; 3 the address cannot be bound (the port is in use, or not allowed)."""

EXIT_OK, EXIT_START_FAILED, EXIT_BAD_SETTINGS, EXIT_CANNOT_BIND = 0, 1, 2, 3
