"""The largest feasible batch size, without Lightning (docs/design.md section 7): the study's
storage and names (:mod:`.study`), the search (:mod:`.search`), the predictions that start
it (:mod:`.predict`) and the search across data-parallel ranks (:mod:`.ranks`)."""
