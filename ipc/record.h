// Records and options written once. A record's fields are one list, X(type, name, comment)
// (an "X macro"): its struct declares them with SHMGRAD_DECLARE_FIELD, and python/binding.cc
// exposes the same list to Python by name (shmgrad._C.RECORDS), from which shmgrad's
// Python classes are built. Adding a field is one line in its list (and its test).
//
// An options struct (what a call or a server takes) is the same with a default:
// X(type, name, default, doc, ...), declared with SHMGRAD_DECLARE_OPTION; the binding
// passes it by field name and exports names, defaults and docs (shmgrad._C.*_OPTIONS), from
// which the Python signatures and the command line take theirs.
#pragma once

#define SHMGRAD_DECLARE_FIELD(type, name, comment) type name{};
#define SHMGRAD_DECLARE_OPTION(type, name, default_value, ...) type name = default_value;
