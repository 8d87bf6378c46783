"""The hand-off between a front process and an engine process (issue 30's layout, its first part).

A front runs the doors and the protocol core and imports no torch; an engine owns the models and
batches across every front. Between them:

- an arena (arena.py): shared memory a front creates for one connection to an engine, cut into
  slots of a fixed size. The memory is anonymous (memory.py: a memfd, every page reserved when it
  is made, sealed at its size), its descriptor handed to the engine over the Unix socket as the
  connection begins (frames.py): no name in /dev/shm, none a client could register as a region,
  and nothing left once both processes have unmapped it, however either ended. A request's rows are copied once from its body into a slot, and the
  engine writes the answer back into the same slot; a request too large for a slot takes a slot
  of its own size in the arena's large area, whose pages are taken only while it is in flight. Each slot carries a generation number, renewed every time the slot is
  taken, which the engine writes beside the answer and the front checks before it reads it.
- small control messages (messages.py) over a Unix socket, written as one frame per turn of the
  sender's event loop, however many requests or answers the turn produced (frames.py).

The front's side is front.py (EngineClient: `infer`, `infer_soon` and `infer_monte_carlo`, each of
one `Ask`: what the engine facade's models take, with the model's name and the request's context;
model control) and remote.py (RemoteEngine: the engine facade the doors are served in a front, from
the engine's table); the engine's is engine.py (EngineServer, on the engine: the requests of a frame
queued together, the table sent to every front).

What may go wrong, and what each side does:
- The engine process dies: the front reads the socket's end, answers every request it had in
  flight Unavailable (503 with Retry-After) at once, and drops the arena with the connection: a
  new connection gets a new arena, so nothing a dead engine (or one still dying) wrote can reach
  a later request. The next request connects again, to the engine restarted meanwhile.
- A client leaves while its request is in the engine: the front asks the engine to cancel it,
  and its slot is taken again only once the engine has answered for it (answer or cancellation),
  so an answer late by any amount is never written over another request's rows.
- No free slot: Overloaded (429 with Retry-After), as a full queue is.
"""
