// Records written once. A record's fields are one list, X(type, name, comment) (an "X
// macro"): its struct declares them with SHMGRAD_DECLARE_FIELD, and python/binding.cc
// exposes the same list to Python by name (shmgrad._C.RECORDS), from which shmgrad's
// Python classes are built. Adding a field is one line in its list (and its test).
#pragma once

#define SHMGRAD_DECLARE_FIELD(type, name, comment) type name{};
