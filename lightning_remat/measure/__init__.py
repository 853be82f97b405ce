"""Measurement, the truth every prediction is held to (docs/design.md section 6): the CPU
allocation log (:mod:`.allocations`), the storage meter (:mod:`.storage`), a step's peak on
every device (:mod:`.peak`) and the op-by-op timeline of a real step (:mod:`.timeline`)."""
