"""The checking machine: grades any exercise without knowing which chapter it is.

It runs an answer in a sandboxed child (:mod:`~graders.machine.runner`, forked from a pre-imported
:mod:`~graders.machine.forkserver`, confined by :mod:`~graders.machine.sandbox` and
:mod:`~graders.machine.cgroups`), reads back what the child wrote (:mod:`~graders.machine.wire`:
JSON and safetensors, never pickle), and compares it with the reference within the tolerance table
(:mod:`~graders.machine.tolerances`) in :mod:`~graders.machine.core`. An exercise is a
:class:`~graders.machine.exercise.Exercise`; :mod:`~graders.machine.registry` finds a chapter's case
library by the exercise id, and :mod:`~graders.machine.points` is the book's one points table.
Nothing here imports a chapter (``graders.chapters``) or a course job (``graders.course``).
"""
