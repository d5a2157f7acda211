// The round trip of one cache line between CPU 0 and CPU 1 (two pinned threads bouncing a flag
// 200000 times), in nanoseconds. On the 2-core development VM it reads 50-74 ns, and 331 ns
// when the host has put the two vCPUs far apart: the runs of our shared-memory collectives
// that came out 3-4x slower (docs/BENCHMARKS.md, "the vCPUs far apart") followed such a
// reading. Run it before a benchmark to know which placement the benchmark met:
//   gcc -O2 -pthread -o /tmp/cache_line_round_trip xtask/probes/cache_line_round_trip.c
//   /tmp/cache_line_round_trip
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdatomic.h>
#include <time.h>
static _Atomic int flag __attribute__((aligned(64)));
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static void* other(void*a){pin(1);for(int i=0;i<200000;i++){while(atomic_load(&flag)!=1);atomic_store(&flag,0);}return 0;}
int main(){pthread_t t;pthread_create(&t,0,other,0);pin(0);struct timespec a,b;clock_gettime(CLOCK_MONOTONIC,&a);
for(int i=0;i<200000;i++){atomic_store(&flag,1);while(atomic_load(&flag)!=0);}clock_gettime(CLOCK_MONOTONIC,&b);
pthread_join(t,0);printf("%.0f\n",((b.tv_sec-a.tv_sec)*1e9+(b.tv_nsec-a.tv_nsec))/200000.0);}
