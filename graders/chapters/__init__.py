"""One case library per chapter (``chNN.py``; chapter 11's capstone in ``ch11_capstone.py``): each
declares its ``EXERCISES`` (:class:`graders.machine.exercise.Exercise`: reference, edge, random and
hidden cases, hints that name the mistake from what the answer returned, drivers for stateful
exercises) and imports only the checking machine (``graders.machine``), the reference package and
shared case builders of this package (:mod:`~graders.chapters.cases`; chapter 10's rank harness
:mod:`~graders.chapters.tp_ranks`). :mod:`~graders.chapters.shown` lists what ``show_reference``
prints per exercise. The machine finds these modules by exercise id (graders.machine.registry).
"""
