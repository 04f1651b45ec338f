"""A request's trace: its events read back and ordered (:mod:`.events`, what ``stageferry trace`` prints
and saves), drawn as one HTML page (:mod:`.html`, ``stageferry trace ID --html``) and arranged for the
console's timeline (:mod:`.report`, ``/console/api/trace``)."""
