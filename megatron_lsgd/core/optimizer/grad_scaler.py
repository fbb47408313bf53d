"""Loss scaling for fp16: constant, or dynamic (halve on overflow after `hysteresis`
overflows, double after `growth_interval` clean steps)."""

from __future__ import annotations


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
