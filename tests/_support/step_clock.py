"""A clock for tests of real-time deadlines: every reading moves it a fixed step, so lateness follows the count of
readings, not the machine's speed."""


class StepClock:
    """A settable clock that moves `step` seconds at every reading (`now` is the last reading)."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now
