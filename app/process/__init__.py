"""Process machinery: the serving process, the supervisor and its workers, the engine process, start-up and exits."""
